"""Layer 5, the job: the top of a rank's program.

run (`run(job)`: how each recovery mode starts, trains and ends) and script (`connect()`: the same for a
training script of your own).

The rule: a module here imports only from this layer and the ones below (membership, training, transport,
core); the layers, lowest first, are ulfmtrain._LAYERS.
"""
