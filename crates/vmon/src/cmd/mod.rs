pub mod doctor;
pub mod image;
