"""Layer 4, membership: who is in the world, the one repair loop's extensions.

spares (waiting processes take a dead rank's slot), respawn and respawn_batch (newcomers spawned in the
background join at a step boundary), forkserver and spawn_shim (a newcomer starts as a fork of a process
that imported torch already), reinit (global restart with replacements).  This layer sits above training:
a newcomer is caught up with the trainer's state and its data holdings, on its slot's device.

The rule: a module here imports only from this layer and the ones below (training, transport, core); the
layers, lowest first, are ulfmtrain._LAYERS.
"""
