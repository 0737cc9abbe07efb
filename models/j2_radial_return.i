# Rate-independent J2 plasticity with linear isotropic hardening, by radial return: the
# trial state fixes the flow directions from the old state, so the return map solves one
# scalar (the flow rate) from the Fischer-Burmeister form of the consistency condition.
# A constant-extrapolation predictor starts Newton from the old flow rate.
[Models]
  # ---------------------------------------------------------------- the trial state
  [trial_elastic_strain]
    type = SR2LinearCombination
    from = 'E plastic_strain~1'
    to = 'Ee_trial'
    weights = '1 -1'
  []
  [trial_stress]
    type = LinearIsotropicElasticity
    coefficients = '1e5 0.3'
    coefficient_types = 'YOUNGS_MODULUS POISSONS_RATIO'
    strain = 'Ee_trial'
    stress = 'S_trial'
  []
  [trial_mandel_stress]
    type = IsotropicMandelStress
    cauchy_stress = 'S_trial'
    mandel_stress = 'M_trial'
  []
  [trial_isoharden]
    type = LinearIsotropicHardening
    equivalent_plastic_strain = 'equivalent_plastic_strain~1'
    isotropic_hardening = 'k_trial'
    hardening_modulus = 1000
  []
  [trial_vonmises]
    type = SR2Invariant
    invariant_type = 'VONMISES'
    tensor = 'M_trial'
    invariant = 's_trial'
  []
  [trial_yield]
    type = YieldFunction
    yield_stress = 1000
    yield_function = 'fp_trial'
    effective_stress = 's_trial'
    isotropic_hardening = 'k_trial'
  []
  [trial_flow]
    type = ComposedModel
    models = 'trial_vonmises trial_yield'
  []
  [trial_normality]
    type = Normality
    model = 'trial_flow'
    function = 'fp_trial'
    from = 'M_trial k_trial'
    to = 'NM Nk'
  []
  [trial_state]
    type = ComposedModel
    models = 'trial_elastic_strain trial_stress trial_mandel_stress trial_isoharden
              trial_normality'
  []
  # ---------------------------------------------------------------- the return map
  [isoharden]
    type = LinearIsotropicHardening
    hardening_modulus = 1000
  []
  [plastic_strain_rate]
    type = AssociativePlasticFlow
    flow_direction = 'NM'
  []
  [plastic_strain]
    type = SR2ForwardEulerTimeIntegration
    variable = 'plastic_strain'
  []
  [elastic_strain]
    type = SR2LinearCombination
    from = 'E plastic_strain'
    to = 'elastic_strain'
    weights = '1 -1'
  []
  [cauchy_stress]
    type = LinearIsotropicElasticity
    coefficients = '1e5 0.3'
    coefficient_types = 'YOUNGS_MODULUS POISSONS_RATIO'
    strain = 'elastic_strain'
  []
  [mandel_stress]
    type = IsotropicMandelStress
    cauchy_stress = 'stress'
  []
  [vonmises]
    type = SR2Invariant
    invariant_type = 'VONMISES'
    tensor = 'mandel_stress'
    invariant = 'effective_stress'
  []
  [yield_surface]
    type = YieldFunction
    yield_stress = 1000
    isotropic_hardening = 'isotropic_hardening'
  []
  [equivalent_plastic_strain_rate]
    type = AssociativeIsotropicPlasticHardening
    isotropic_hardening_direction = 'Nk'
  []
  [equivalent_plastic_strain]
    type = ScalarForwardEulerTimeIntegration
    variable = 'equivalent_plastic_strain'
  []
  [consistency]
    type = FBComplementarity
    a = 'yield_function'
    a_inequality = 'LE'
    b = 'flow_rate'
  []
  [surface]
    type = ComposedModel
    models = 'plastic_strain_rate plastic_strain elastic_strain cauchy_stress mandel_stress
              equivalent_plastic_strain_rate equivalent_plastic_strain isoharden
              vonmises yield_surface consistency'
  []
[]

[EquationSystems]
  [eq_sys]
    type = NonlinearSystem
    model = 'surface'
    unknowns = 'flow_rate'
    residuals = 'complementarity'
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
  [predictor]
    type = ConstantExtrapolationPredictor
    unknowns_Scalar = 'flow_rate'
  []
  [return_map]
    type = ImplicitUpdate
    equation_system = 'eq_sys'
    solver = 'newton'
    predictor = 'predictor'
  []
  [model]
    type = ComposedModel
    models = 'trial_state return_map plastic_strain_rate plastic_strain
              equivalent_plastic_strain_rate equivalent_plastic_strain
              elastic_strain cauchy_stress'
    additional_outputs = 'plastic_strain equivalent_plastic_strain'
  []
[]
