# Linear isotropic elasticity with one Young's modulus per row, baked into the graphs: a
# [Tensors] entry of shape (2,) bound to a coefficient. torch.export cannot keep the batch
# dynamic then, so the artifact is compiled for exactly the example batch of 2.
[Tensors]
  [E]
    type = Python
    expr = '''
import torch
result = torch.tensor([100.0, 250.0])
'''
  []
[]

[Settings]
  dynamic_batch = false
  example_batch_shape = '(2,)'
[]

[Models]
  [elasticity]
    type = LinearIsotropicElasticity
    strain = 'strain'
    stress = 'stress'
    coefficients = 'E 0.3'
    coefficient_types = 'YOUNGS_MODULUS POISSONS_RATIO'
  []
[]
