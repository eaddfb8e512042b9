"""The policies behind the streaming front, one folder each with the same file names (`policy`, `cache`,
`attention`); the contract they implement and the registry the front finds them in are `hermes.policy`."""
