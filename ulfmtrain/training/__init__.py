"""Layer 3, training: the optimizer wrapper and its buckets, the trainer, models and devices, the typed job.

buckets, overlap, streams, optim, closure, replicated, rng (the step: gradients reduced in buckets), job_state
(the job's named state every replica must agree on, handed to a replacement), serialize (that state as bytes,
loaded as data only), end_check (the agreed replica check at a script's end), ddp (torch.distributed's default
group, DistributedDataParallel), device,
models, trainer, and config (TrainConfig and TrainJob, once
job.py: the trainer takes a TrainConfig and reinit rebuilds a TrainJob, so the job's description sits here,
below both).  The packages ulfmtrain.data and ulfmtrain.checkpoint belong to this layer too.

The rule: a module here imports only from this layer and the ones below (transport, core); the layers,
lowest first, are ulfmtrain._LAYERS.
"""
