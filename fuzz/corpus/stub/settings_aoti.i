[Settings]
  dynamic_batch = false
  example_batch_shape = '(2,)'
[]
[Models]
  [model]
    type = AOTIModel
    artifact_path = 'model'
  []
[]
