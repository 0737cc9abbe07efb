[Models]
  [model]
    type = "AOTIModel # not a comment"
    artifact_path = 'a b # c'
  []
[]
