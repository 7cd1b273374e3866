"""Pure vocab-parallel sampling mathematics (docs/architecture.md §4, §6).

No ``torch.distributed`` here: the sampler reaches the other ranks only
through an injected exchange (:mod:`tpguide.sampling.exchange`).
"""
