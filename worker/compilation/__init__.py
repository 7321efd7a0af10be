"""torch.compile of the model (``--compilation-config`` mode 3): ``compiled_model`` applies it
on a worker, ``attention_op`` is the opaque attention op the traced graph is split at,
``piecewise_backend`` the Dynamo backend that compiles the pieces with Inductor,
``compile_cache`` keeps them on disk between starts, ``warm_start`` rebuilds the compiled
forward from the cache without a Dynamo trace, and ``piecewise_graphs`` captures the pieces as
CUDA graphs (``cudagraph_mode`` PIECEWISE / FULL_AND_PIECEWISE)."""
