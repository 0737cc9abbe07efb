# binned_precipitation.i with a weak dissolution term, 1e-3 mobility (sqrt|n - 0.125| + eps)^2,
# whose derivative is not finite where a bin holds exactly 0.125: a point frozen there (a
# mobility of exactly 0, T = 0.001) is converged at its first guess, yet its Jacobian is
# NaN, which fails NEML2's batched Newton for every point beside it
# (tools/make_reference.py --mixed-batch). A test model, not a physical one; its pow is
# opaque to Inductor, so it is not the one the benchmarks time.

[Tensors]
  [edges]
    type = Python
    expr = 'logspace(Scalar(-1.0).sub_batch, Scalar(0.0).sub_batch, 9)'
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
  [density_offset]
    type = ScalarLinearCombination
    from = 'number_density'
    to = 'density_offset'
    weights = '1'
    offset = -0.125
  []
  [dissolution_norm]
    type = ScalarPNorm
    from = 'density_offset'
    to = 'dissolution_norm'
    exponent = 0.5
  []
  [dissolution]
    type = ScalarMultiplication
    from = 'mobility dissolution_norm'
    to = 'dissolution'
    scaling = 1e-3
  []
  [density_rate]
    type = ScalarLinearCombination
    from = 'nucleation_flux flux_div dissolution'
    to = 'number_density_rate'
    weights = '1 1 -1'
  []
  [integrate]
    type = ScalarBackwardEulerTimeIntegration
    variable = 'number_density'
  []
  [rate]
    type = ComposedModel
    models = 'mobility volume_fraction supersaturation growth_rate edge_velocity flux
              closed_left closed_right divergence nucleation_rate nucleation density_offset
              dissolution_norm dissolution density_rate integrate'
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
