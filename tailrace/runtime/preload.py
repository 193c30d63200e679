"""What the fork server imports once (procs.context): torch and the worker bodies, so each worker
process forked from it starts without importing them again (1-3 s a process on 2 cores). torch's
optimizers import torch._dynamo when first built (another 2 s): it is imported here too."""

import torch  # noqa: F401
import torch._dynamo  # noqa: F401

import tailrace.runtime.engine_worker  # noqa: F401
import tailrace.runtime.trainer_worker  # noqa: F401
