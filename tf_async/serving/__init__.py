"""Scale-out: N engine replicas behind one OpenAI endpoint (`tf-async serve --replicas N`)
and a Ray Serve application for a cluster (ray_app.py). The front speaks the project's own
OpenAI HTTP API to full-engine replicas; it never touches engine internals."""
