"""A site's round in each sync mode: the round pipeline (loop), the exchanges over torchft's quorum
(sync, overlap, ddp), async mode, and the torchft wiring.
"""
