"""The names of mpi4py's communicator methods, by how they involve a method's peers.

One list for every module that must know: the guard (which calls communicate at all),
the watchdog (which wait for peers, which start what it cannot see) and the checking
mode (which are collective). The lower-case methods (pickled Python objects) are the
same calls as their capitalised ones.
"""


def _names(text: str) -> frozenset[str]:
    return frozenset(text.split())


# Collectives that block until every rank of the communicator takes part.
COLLECTIVES = _names("""
    Allreduce allreduce Allgather allgather Allgatherv Alltoall alltoall Alltoallv
    Alltoallw Bcast bcast Reduce reduce Gather gather Gatherv Scatter scatter Scatterv
    Barrier barrier Reduce_scatter Reduce_scatter_block Scan scan Exscan exscan""")
# Collectives whose counts may legitimately differ between ranks.
VARIABLE = _names("""
    Allgatherv Alltoallv Alltoallw Gatherv Scatterv allgather gather scatter alltoall
    bcast reduce allreduce scan exscan""")
# Collectives over a topology's neighbours, blocking.
NEIGHBOURS = _names("""
    Neighbor_allgather Neighbor_allgatherv Neighbor_alltoall Neighbor_alltoallv
    Neighbor_alltoallw neighbor_allgather neighbor_alltoall""")
# Point-to-point calls that block until a peer takes part.
POINT_TO_POINT_BLOCKING = _names("""
    Send send Ssend ssend Bsend bsend Rsend Recv recv Sendrecv sendrecv Sendrecv_replace
    Probe probe Mprobe mprobe""")
BLOCKING = COLLECTIVES | NEIGHBOURS | POINT_TO_POINT_BLOCKING
# Collectives that make a communicator.
MAKERS = _names("""
    Clone Dup Dup_with_info Split Split_type Create Create_group Create_cart Create_graph
    Create_dist_graph Create_dist_graph_adjacent Create_intercomm""")
# Calls that start an operation and return a request: a wait on it happens later.
# (So do the persistent `*_init` ones.)
POINT_TO_POINT_STARTERS = _names("""
    Isend isend Ibsend ibsend Issend issend Irsend Irecv irecv Isendrecv Isendrecv_replace""")
STARTERS = POINT_TO_POINT_STARTERS | _names("""
    Iallreduce Iallgather Iallgatherv Ialltoall Ialltoallv Ialltoallw Ibarrier Ibcast
    Igather Igatherv Ireduce Ireduce_scatter Ireduce_scatter_block Iscan Iexscan Iscatter
    Iscatterv Ineighbor_allgather Ineighbor_allgatherv Ineighbor_alltoall
    Ineighbor_alltoallv Ineighbor_alltoallw Idup""")
PERSISTENT = _names("Send_init Recv_init Ssend_init Bsend_init Rsend_init")
# Every point-to-point call, blocking or not, probes included.
POINT_TO_POINT = (POINT_TO_POINT_BLOCKING | POINT_TO_POINT_STARTERS | PERSISTENT
                  | _names("Iprobe iprobe Improbe improbe"))
# Every method that communicates.
COMMUNICATING = BLOCKING | MAKERS | STARTERS | POINT_TO_POINT
