"""The outer step (Nesterov on the averaged pseudo-gradient) and what screens its inputs: the guard,
robust aggregation, and the checks on a healed state.
"""
