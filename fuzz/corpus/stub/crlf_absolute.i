[Models]
  [model]
    type = AOTIModel
    artifact_path = /abs/path
    artifact_path = second
  []
[]
