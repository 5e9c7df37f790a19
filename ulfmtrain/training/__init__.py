"""Layer 3, training: the optimizer wrapper and its buckets, the trainer, models and devices, the typed job.

buckets, overlap, streams, optim, replicated, rng, extra_state (the step: gradients reduced in buckets, the
state every replica must agree on), ddp (torch.distributed's default group, DistributedDataParallel), device,
models, trainer, and config (TrainConfig and TrainJob, once
job.py: the trainer takes a TrainConfig and reinit rebuilds a TrainJob, so the job's description sits here,
below both).  The packages ulfmtrain.data and ulfmtrain.checkpoint belong to this layer too.

The rule: a module here imports only from this layer and the ones below (transport, core); the layers,
lowest first, are ulfmtrain._LAYERS.
"""
