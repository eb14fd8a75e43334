"""The job's processes: which rank plays which role (topology, device meshes), the hidden-state channel
between target and drafter ranks, stop signals, the output directory's lock and how a failing rank exits.
"""
