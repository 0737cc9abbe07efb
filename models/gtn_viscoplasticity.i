# Porous viscoplasticity: a Gurson-Tvergaard-Needleman yield surface (von Mises and the
# hydrostatic stress, softened by the void fraction), Perzyna flow normal to it, Voce
# isotropic hardening, and void growth from the plastic volume change (Gurson
# cavitation). Rate form: stress, the equivalent plastic strain and the void fraction are
# the unknowns of one backward-Euler step. A nonzero initial void fraction makes voids grow.
[Models]
  [mandel_stress]
    type = IsotropicMandelStress
    cauchy_stress = 'stress'
  []
  [vonmises]
    type = SR2Invariant
    invariant_type = 'VONMISES'
    tensor = 'mandel_stress'
    invariant = 'flow_invariant'
  []
  [pressure]
    type = SR2Invariant
    invariant_type = 'I1'
    tensor = 'mandel_stress'
    invariant = 'poro_invariant'
  []
  [isotropic_hardening]
    type = VoceIsotropicHardening
    saturated_hardening = 50
    saturation_rate = 2
  []
  [yield_surface]
    type = GTNYieldFunction
    yield_stress = 60
    q1 = 1.5
    q2 = 1
    q3 = 2.25
    isotropic_hardening = 'isotropic_hardening'
  []
  [flow]
    type = ComposedModel
    models = 'vonmises pressure yield_surface'
  []
  [normality]
    type = Normality
    model = 'flow'
    function = 'yield_function'
    from = 'mandel_stress isotropic_hardening'
    to = 'flow_direction isotropic_hardening_direction'
  []
  # The GTN yield function is dimensionless: so is the reference "stress".
  [flow_rate]
    type = PerzynaPlasticFlowRate
    reference_stress = 1
    exponent = 2
  []
  [plastic_strain_rate]
    type = AssociativePlasticFlow
  []
  [equivalent_plastic_strain_rate]
    type = AssociativeIsotropicPlasticHardening
  []
  [void_growth]
    type = GursonCavitation
  []
  [total_strain_rate]
    type = SR2VariableRate
    variable = 'E'
  []
  [elastic_strain_rate]
    type = SR2LinearCombination
    from = 'E_rate plastic_strain_rate'
    to = 'strain_rate'
    weights = '1 -1'
  []
  [elasticity]
    type = LinearIsotropicElasticity
    coefficients = '3e4 0.3'
    coefficient_types = 'YOUNGS_MODULUS POISSONS_RATIO'
    rate_form = true
  []
  [integrate_stress]
    type = SR2BackwardEulerTimeIntegration
    variable = 'stress'
  []
  [integrate_ep]
    type = ScalarBackwardEulerTimeIntegration
    variable = 'equivalent_plastic_strain'
  []
  [integrate_void]
    type = ScalarBackwardEulerTimeIntegration
    variable = 'void_fraction'
  []
  [implicit_rate]
    type = ComposedModel
    models = 'mandel_stress vonmises pressure isotropic_hardening yield_surface normality
              flow_rate plastic_strain_rate equivalent_plastic_strain_rate void_growth
              total_strain_rate elastic_strain_rate elasticity integrate_stress integrate_ep
              integrate_void'
  []
[]

[EquationSystems]
  [eq_sys]
    type = NonlinearSystem
    model = 'implicit_rate'
    unknowns = 'stress equivalent_plastic_strain void_fraction'
    residuals = 'stress_residual equivalent_plastic_strain_residual void_fraction_residual'
  []
[]

[Solvers]
  [newton]
    type = Newton
    linear_solver = 'lu'
  []
  [lu]
    type = DenseLU
  []
[]

[Models]
  [model]
    type = ImplicitUpdate
    equation_system = 'eq_sys'
    solver = 'newton'
  []
[]
