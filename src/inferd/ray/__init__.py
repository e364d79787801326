"""inferd on Ray Serve (`pip install 'inferd[ray]'`): `inferd.ray.serve` is the application
(`serve run inferd.ray.serve:app`, or `build_app(args)` from a Serve config file), `client` the
engine client the OpenAI ingress holds over a deployment of engine replicas, `router` the
prefix-aware request router of that deployment. The only package besides
`inferd.distributed.ray_executor` that imports `ray` (an import-linter contract)."""
