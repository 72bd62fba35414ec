//! Llama's architecture in tch, as transformers' `LlamaForCausalLM` computes it: RMSNorm, rotary position
//! embeddings, grouped-query attention, a SwiGLU MLP, tied or untied embeddings. Variable names are transformers'
//! state-dict names, so a Hugging Face checkpoint loads by name and the trained model goes back in its form.
//! Shared by examples/llama/ and the tests.
#![allow(dead_code)]
mod config;
mod layers;
mod model_parallel;
mod scoped;

// Every example and test that includes this uses its own part of it.
#[allow(unused_imports)]
pub use {config::*, layers::*, model_parallel::*, scoped::*};
