# A crystal-plasticity-like model written for the tests: per material point, 12 slip
# systems' hardening h (an unknown with a sub-batch axis of 12) and the accumulated slip p
# (a plain scalar unknown), solved together by backward Euler. Each system slips at
# w_i (f - g_i) / g_i with g_i = 1 + h_i, under a resolved force f per point; p sums the
# slip rates, and each h_i hardens as 0.2 p_rate g_i.

[Tensors]
  [slip_weights]
    type = Python
    expr = 'Scalar(torch.linspace(0.5, 1.5, 12, dtype=torch.float64), sub_batch_ndim=1)'
  []
  [unit_radius] # 4/3 pi R^3 = 1: PrecipitateVolumeFraction sums the systems
    type = Python
    expr = 'Scalar(torch.full((12,), (3.0 / (4.0 * 3.141592653589793)) ** (1.0 / 3.0), dtype=torch.float64), sub_batch_ndim=1)'
  []
[]

[EquationSystems]
  [eq_sys]
    type = NonlinearSystem
    model = 'rate'
    unknowns = 'hardening p'
  []
[]

[Solvers]
  [newton]
    type = Newton
    linear_solver = 'lu'
    rel_tol = 1e-10
    abs_tol = 1e-12
    max_its = 30
  []
  [lu]
    type = DenseLU
  []
[]

[Models]
  [strength]
    type = ScalarLinearCombination
    from = 'hardening'
    to = 'strength'
    weights = '1'
    offset = 1.0
  []
  [overstress]
    type = ScalarLinearCombination
    from = 'f strength'
    to = 'overstress'
    weights = '1 -1'
  []
  [slip_rate]
    type = ScalarMultiplication
    from = 'overstress strength'
    to = 'slip_rate'
    reciprocal = 'false true'
    scaling = 'slip_weights'
  []
  [total_slip_rate]
    type = PrecipitateVolumeFraction
    radius = 'unit_radius'
    number_density = 'slip_rate'
    volume_fraction = 'p_rate'
  []
  [hardening_rate]
    type = ScalarMultiplication
    from = 'p_rate strength'
    to = 'hardening_rate'
    scaling = 0.2
  []
  [integrate_hardening]
    type = ScalarBackwardEulerTimeIntegration
    variable = 'hardening'
  []
  [integrate_slip]
    type = ScalarBackwardEulerTimeIntegration
    variable = 'p'
  []
  [rate]
    type = ComposedModel
    models = 'strength overstress slip_rate total_slip_rate hardening_rate integrate_hardening
              integrate_slip'
  []
  [model]
    type = ImplicitUpdate
    equation_system = 'eq_sys'
    solver = 'newton'
  []
[]
