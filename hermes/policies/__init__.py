"""The policies behind the streaming front, one folder each with the same file names (`policy`, `cache`,
`attention`); the contract they implement is `hermes.policy`, the registry the front finds them in (these and
installed packages' policies) `hermes.registry`."""
