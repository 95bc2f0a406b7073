"""Measurements a node runs for tune-h and doctor: the WAN link probe and the inner step's time.
"""
