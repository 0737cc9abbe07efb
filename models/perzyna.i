# Perzyna's viscoplastic flow rate, (<f>/eta)^n: its power goes through the custom
# operator neml2::opaque_pow, which the loader must register.
[Models]
  [perzyna]
    type = PerzynaPlasticFlowRate
    reference_stress = 150
    exponent = 6
  []
[]
