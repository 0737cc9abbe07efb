[Tensors]
  [E]
    type = Python
    expr = """
[Models]
  [model]
    artifact_path = "elsewhere"
[]
result = Scalar(torch.tensor(1.0))
"""
  []
[]
[Models]
  [model]
    type = AOTIModel
    artifact_path = 'model'
  []
[]
