"""What every layer may use and that knows nothing of attention: crash-safe files
(:mod:`.fileio`), figures (:mod:`.figures`) and the test pause points (:mod:`.testing`)."""
