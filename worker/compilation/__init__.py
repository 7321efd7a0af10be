"""torch.compile of the model (``--compilation-config`` mode 3): ``compiled_model`` applies it
on a worker, ``attention_op`` is the opaque attention op the traced graph is split at,
``piecewise_backend`` the Dynamo backend that compiles the pieces with Inductor, and
``compile_cache`` keeps them on disk between starts."""
