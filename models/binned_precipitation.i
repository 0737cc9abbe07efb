# A small precipitation-like model with binned state, written for the tests: a number
# density over 8 size bins (a sub-batch axis of the unknown) advected up the size axis at a
# rate that falls as the precipitated volume grows (so every bin's update depends on every
# other bin's), with nucleation into the smallest bin; backward Euler in time, Newton with
# a dense LU per material point. T is a homologous temperature (about 0.5 to 1.5): the
# mobility is 20 exp(-3 / T). models/CMakeLists.txt compiles it over 300 bins as well.

bins = 8

[Tensors]
  [edges]
    type = Python
    expr = 'logspace(Scalar(-1.0).sub_batch, Scalar(0.0).sub_batch, ${bins} + 1)'
  []
  [centers]
    type = Python
    expr = 'Scalar(0.5 * (edges.data[..., :-1] + edges.data[..., 1:]), sub_batch_ndim=1)'
  []
  [inverse_centers]
    type = Python
    expr = 'Scalar(1.0 / centers.data, sub_batch_ndim=1)'
  []
  [dx]
    type = Python
    expr = 'Scalar(edges.data[..., 1:] - edges.data[..., :-1], sub_batch_ndim=1)'
  []
[]

[EquationSystems]
  [eq_sys]
    type = NonlinearSystem
    model = 'rate'
    unknowns = 'number_density'
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
  [mobility]
    type = ArrheniusParameter
    temperature = 'T'
    reference_value = 20
    activation_energy = 3
    ideal_gas_constant = 1
  []
  [volume_fraction]
    type = PrecipitateVolumeFraction
    radius = 'centers'
    number_density = 'number_density'
    volume_fraction = 'vf'
  []
  [supersaturation]
    type = ScalarLinearCombination
    from = 'vf'
    to = 'supersaturation'
    weights = '-1'
    offset = 0.05
  []
  [growth_rate]
    type = ScalarMultiplication
    from = 'mobility supersaturation'
    to = 'growth_rate'
    scaling = 'inverse_centers'
  []
  [edge_velocity]
    type = LinearlyInterpolateToCellEdges
    cell_values = 'growth_rate'
    cell_centers = 'centers'
    cell_edges = 'edges'
    edge_values = 'v_edge'
  []
  [flux]
    type = FiniteVolumeUpwindedAdvectiveFlux
    u = 'number_density'
    v_edge = 'v_edge'
    flux = 'J'
  []
  [closed_left]
    type = FiniteVolumeAppendBoundaryCondition
    input = 'J'
    bc_value = 0.0
    side = 'left'
  []
  [closed_right]
    type = FiniteVolumeAppendBoundaryCondition
    input = 'J_with_bc_left'
    bc_value = 0.0
    side = 'right'
  []
  [divergence]
    type = FiniteVolumeGradient
    u = 'J_with_bc_left_with_bc_right'
    dx = 'dx'
    grad_u = 'flux_div'
  []
  [nucleation_rate]
    type = ScalarMultiplication
    from = 'mobility supersaturation'
    to = 'nucleation_magnitude'
    scaling = 50.0
  []
  [nucleation]
    type = DumpInSmallestBin
    magnitude = 'nucleation_magnitude'
    cell_centers = 'centers'
    dumped_source = 'nucleation_flux'
  []
  [density_rate]
    type = ScalarLinearCombination
    from = 'nucleation_flux flux_div'
    to = 'number_density_rate'
    weights = '1 1'
  []
  [integrate]
    type = ScalarBackwardEulerTimeIntegration
    variable = 'number_density'
  []
  [rate]
    type = ComposedModel
    models = 'mobility volume_fraction supersaturation growth_rate edge_velocity flux
              closed_left closed_right divergence nucleation_rate nucleation density_rate
              integrate'
  []
  [predictor]
    type = ConstantExtrapolationPredictor
    unknowns_Scalar = 'number_density'
  []
  [model]
    type = ImplicitUpdate
    equation_system = 'eq_sys'
    solver = 'newton'
    predictor = 'predictor'
  []
[]
