"""The emulated cluster's node side: images read from the project's Dockerfiles and a pod runtime that runs
each container's real command in namespaces of its own (``images``, ``runtime``, ``podinit``)."""
