"""The NWS method itself: the NWS layer (a weight parametrization), exact nearest-pool search
(BLAS + NumPy on CPU, one Triton kernel on CUDA), the model-level search engine, pools and their
k-means initialisation, and the operations on a converted model (:mod:`.nwsmodel`).

Nothing here reads or writes files except :class:`~nwsconvert.core.pools.PoolSet`'s save/load.
"""
