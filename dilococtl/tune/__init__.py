"""tune-h: measure the WAN and the step time, model a round's sync, choose H.

Read in this order: measure.py (links and step times, on the nodes), transfer.py and model.py (what
a round's exchange costs on those links; tls_model.py for the TLS transport), choose.py (the H that keeps
sync within the budget, and the whole result), tune_h.py (the command: all of it once, recorded),
history.py (tunes read back by launch, status and report). defaults.py holds the CLI's defaults
without importing any of it.
"""
