"""The coordinators a run starts beside its sites: torchft's Lighthouse and the async outer service.
"""
