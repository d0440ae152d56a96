"""The edge's link to the cloud: a client per replica, the replica set that fails over between them,
the verify session a generation holds open (why an attempt failed, and what follows, is failures.py's
table), and the round's cloud backend built on it."""
