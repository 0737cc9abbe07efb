# Linear isotropic elasticity (elasticity.i) compiled for a fixed batch of 2: nothing in it
# is per row, so any batch runs in chunks of 2.
[Settings]
  dynamic_batch = false
  example_batch_shape = '(2,)'
[]

[Models]
  [elasticity]
    type = LinearIsotropicElasticity
    strain = 'strain'
    stress = 'stress'
    coefficients = '100 0.3'
    coefficient_types = 'YOUNGS_MODULUS POISSONS_RATIO'
  []
[]
