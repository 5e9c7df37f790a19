"""Layer 6, launching: what runs outside the ranks and starts them.

launch (the mpirun command line), lost_daemon (a true status when the normal launch loses a host), agent (the
head node's end of `launch --agent`), supervise (relaunch from the latest checkpoint), stopping (what launch and
supervise do when told to stop, or killed).

The rule: a module here imports only from this layer and the ones below (job, membership, training,
transport, core); the layers, lowest first, are ulfmtrain._LAYERS.
"""
