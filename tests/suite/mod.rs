mod data_parallel;
mod engine;
mod fsdp;
mod pretrain;
mod tensor_parallel;
