[Models]
  [model]
    type = AOTIModel
    artifact_path = ${Models/model/artifact_path}
  []
  [eq]
    type = ${raw AOTI Model}
    artifact_path := 'eq'
  []
[]
