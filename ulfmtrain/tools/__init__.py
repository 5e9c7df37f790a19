"""Layer 7, tools: the demo, comparisons of the recovery modes, their lost-time analysis, plots, the data audit.

The rule: a module here imports only from this layer and the ones below (launching, job, membership,
training, transport, core); the layers, lowest first, are ulfmtrain._LAYERS.  Only cli.py (with __main__
and __init__) sits above.
"""
