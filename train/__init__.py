"""Training scripts: ShareGPT shards and self-distilled answers (`prepare_data`, `distill`), the
shared loop (`loop`: Optax, Orbax resume, data-parallel sharding), each drafter's training (`s3d`:
the mask-token objective, `kangaroo`: the adapter, `s2d`: sorted fine-tuning), draft vocabularies
(`draft_vocab`) and Self-Spec's skip-plan search (`search_skip`). Built on `s3djax`; nothing here
imports `infer`."""
