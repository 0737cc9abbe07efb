# The smallest implicit model: one scalar integrated by backward Euler,
#   x_rate = a - x^2,  residual x - x~1 - (a - x^2) (t - t~1) = 0,
# nonlinear in x (Newton needs a few iterations) and without a real root when a is very
# negative for the step: a row that cannot converge, for the failure tests.
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
  []
[]
