"""Zoo entries for MPE (mpe2): teams of particle agents; simple_spread_v3 by default."""
