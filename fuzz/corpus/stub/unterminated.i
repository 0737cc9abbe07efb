[Models]
  [./model]
    type = AOTIModel
    artifact_path = 'unterminated
  [../]
