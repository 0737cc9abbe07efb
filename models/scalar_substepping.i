# models/scalar_backward_euler.i with adaptive substepping (max_substepping_level = 3): a
# row whose step fails is retried in 2, 4, then 8 substeps, t ramped from t~1 to t and x~1
# chained from substep to substep. x + h x^2 = x~1 + h a has no real root when
# 1 + 4 h (x~1 + h a) < 0, so a very negative a fails in one step of length dt = t - t~1
# and converges in shorter ones.
[Models]
  [copy]
    type = CopyScalar
    from = 'x'
    to = 'x_copy'
  []
  [square]
    type = ScalarMultiplication
    from = 'x x_copy'
    to = 'x_squared'
  []
  [rate]
    type = ScalarLinearCombination
    from = 'a x_squared'
    to = 'x_rate'
    weights = '1 -1'
  []
  [integrate]
    type = ScalarBackwardEulerTimeIntegration
    variable = 'x'
  []
  [residual]
    type = ComposedModel
    models = 'copy square rate integrate'
  []
[]

[EquationSystems]
  [eq_sys]
    type = NonlinearSystem
    model = 'residual'
    unknowns = 'x'
    residuals = 'x_residual'
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
    max_substepping_level = 3
  []
[]
