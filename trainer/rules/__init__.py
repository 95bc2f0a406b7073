"""Torch-free rules of the trainer that the control plane (dilococtl) reads too: the config tables and
their checks, codec specs, the H and outer-step rules, schedules and fragments.
"""
