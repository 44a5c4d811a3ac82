mod data_parallel;
mod fsdp;
mod pretrain;
mod tensor_parallel;
