"""The serving model: what a GPU does with a scenario's requests.

    gpus.py          the GPU catalogue (datasheets) and the achieved efficiencies
    kernel_table.py  a measured per-op table ([serving] kernels) over the efficiencies
    compute.py       the time of a prefill forward and a decode step on one GPU
    memory.py        memory per GPU on each side: weights, activations, KV
    sharding.py      what a TP group splits and what every rank holds whole
    deepep.py        DeepEP's low-latency all-to-all from its published table
    ep_balance.py    expert-parallel load imbalance: the busiest rank sets the layer
    prefill_tbo.py   two-batch overlap in prefill: two micro-batches, comm under compute
    decode_model.py  a decode instance's KV capacity and step time
    prefix_cache.py  the prefill instance's prefix cache (Mooncake hash ids, LRU)

Import from the modules; this package's `__init__` imports nothing, so that the
scenario schema can import the catalogue without pulling the whole model in.
"""
