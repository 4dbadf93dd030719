"""The bridge's gRPC face: the server (`server`), the services (`verify_service`,
`rollout_service`, `health`), their handler tables (`handlers`), the bidirectional streams
(`streams`), the List RPCs' refresh (`listing`) and the interceptors (token, stream limit,
logging)."""
