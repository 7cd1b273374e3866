"""Engine: requests, scheduler, sampler inputs, vocab-parallel sampler, the SPMD loop."""
