# Grains on a sub-batch axis with block-structured unknowns (structure = 'block dense', as
# NEML2's multi-grain crystal-plasticity benchmark writes them), written for the tests: per
# material point, 4 grains each with a hardening h and a slip g (the block group, two values
# a grain, solved grain by grain), and the accumulated slip p of the point (the dense group),
# solved together by backward Euler. Grain i slips at w_i (f - s_i - 0.1 g_i) / s_i with
# s_i = 1 + h_i under a force f per point; p grows at 3 times the sum of the slip rates; h_i
# hardens at 0.2 w_i p s_i (grains meet only through p, so their blocks stay diagonal). A
# forward segment after the solve gives each grain's strength and a quarter of p.

[Tensors]
  [hardening_weights]
    type = Python
    expr = 'Scalar(torch.tensor([0.1, 0.16, 0.22, 0.28], dtype=torch.float64), sub_batch_ndim=1)'
  []
  [grain_weights]
    type = Python
    expr = 'Scalar(torch.tensor([0.5, 0.8, 1.1, 1.4], dtype=torch.float64), sub_batch_ndim=1)'
  []
[]

[EquationSystems]
  [eq_sys]
    type = NonlinearSystem
    model = 'rate'
    unknowns = 'hardening slip; p'
    residuals = 'hardening_residual slip_residual; p_residual'
    structure = 'block dense'
  []
[]

[Solvers]
  [newton]
    type = Newton
    linear_solver = 'schur'
    rel_tol = 1e-10
    abs_tol = 1e-12
    max_its = 30
  []
  [lu]
    type = DenseLU
  []
  [schur]
    type = SchurComplement
    residual_primary_group = '0'
    unknown_primary_group = '0'
    primary_solver = 'lu'
    schur_solver = 'lu'
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
    from = 'f strength slip'
    to = 'overstress'
    weights = '1 -1 -0.1'
  []
  [slip_rate]
    type = ScalarMultiplication
    from = 'overstress strength'
    to = 'slip_rate'
    reciprocal = 'false true'
    scaling = 'grain_weights'
  []
  [slip_tensor] # the grains' sum through an SR2: NEML2 reduces a grain axis on SR2s only
    type = ScalarToDiagonalSR2
    input = 'slip_rate'
    output = 'slip_tensor'
  []
  [total_slip_tensor]
    type = SR2IntermediateSum
    from = 'slip_tensor'
    to = 'total_slip_tensor'
    reduces = 'grain'
  []
  [total_slip_rate] # the trace: 3 times the sum of the grains' slip rates
    type = SR2Invariant
    tensor = 'total_slip_tensor'
    invariant = 'p_rate'
    invariant_type = 'I1'
  []
  [hardening_rate]
    type = ScalarMultiplication
    from = 'p strength'
    to = 'hardening_rate'
    scaling = 'hardening_weights'
  []
  [integrate_hardening]
    type = ScalarBackwardEulerTimeIntegration
    variable = 'hardening'
  []
  [integrate_slip]
    type = ScalarBackwardEulerTimeIntegration
    variable = 'slip'
  []
  [integrate_p]
    type = ScalarBackwardEulerTimeIntegration
    variable = 'p'
  []
  [rate]
    type = ComposedModel
    models = 'strength overstress slip_rate slip_tensor total_slip_tensor total_slip_rate hardening_rate integrate_hardening
              integrate_slip integrate_p'
  []
  [solve]
    type = ImplicitUpdate
    equation_system = 'eq_sys'
    solver = 'newton'
  []
  [grain_strength]
    type = ScalarLinearCombination
    from = 'hardening'
    to = 'grain_strength'
    weights = '1'
    offset = 1.0
  []
  [mean_slip]
    type = ScalarLinearCombination
    from = 'p'
    to = 'mean_slip'
    weights = '0.25'
  []
  [model]
    type = ComposedModel
    models = 'solve grain_strength mean_slip'
    additional_outputs = 'hardening p'
  []
[]
