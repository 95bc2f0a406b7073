"""Pseudo-gradient compression: the Compressor with error feedback, its quantizers, the sparse codec
and the byte accounting of a round's collectives.
"""
