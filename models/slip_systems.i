# A crystal-plasticity-like model written for the tests: per material point, 12 slip
# systems' hardening h (an unknown with a sub-batch axis of 12) and the accumulated slip p
# (a plain scalar unknown), solved together by backward Euler. Each system slips at
# w_i (f - g_i) / g_i with g_i = 1 + h_i, under a resolved force f per point; p sums the
# slip rates, and each h_i hardens as 0.2 p_rate g_i.
# After the solve, as crystal-plasticity models do, a forward segment reads its results:
# each system's strength g_i (sub-batched), the mean over the systems of diag(h_i) (a plain
# SR2 from the sub-batched unknown, as a polycrystal averages its grains' stresses) and the
# work f p (plain, from a plain input and a plain unknown).
# neml2-compile 3.1 cannot take more in that segment: a plain and a sub-batched variable
# in one operation (f - g_i) fails to trace ("The size of tensor a (s72) must match the
# size of tensor b (12)"), and PrecipitateVolumeFraction's sum over the systems compiles to
# a graph that returns (B, 12) values unlike eager NEML2's (B,) sums.

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
  [update]
    type = ImplicitUpdate
    equation_system = 'eq_sys'
    solver = 'newton'
  []
  [system_strength]
    type = ScalarLinearCombination
    from = 'hardening'
    to = 'system_strength'
    weights = '1'
    offset = 1.0
  []
  [hardening_tensor]
    type = ScalarToDiagonalSR2
    input = 'hardening'
    output = 'hardening_tensor'
  []
  [mean_hardening]
    type = SR2IntermediateMean
    from = 'hardening_tensor'
    to = 'mean_hardening'
    reduces = 'system'
  []
  [work]
    type = ScalarMultiplication
    from = 'f p'
    to = 'work'
  []
  [model]
    type = ComposedModel
    models = 'update system_strength hardening_tensor mean_hardening work'
    additional_outputs = 'hardening p'
  []
[]
