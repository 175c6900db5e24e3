//! Which backend a device is: [`base_device`] (the backend under its autodiff wrappers) and
//! [`is_flex`]; `cube::is_cube` and `bonfire_dtensor::plane::is_host` ask it too.

use burn::backend::DispatchDevice;
use burn::tensor::Device;

/// The backend device under `device`'s autodiff wrappers (itself without them).
pub fn base_device(device: &Device) -> DispatchDevice {
    fn strip(d: DispatchDevice) -> DispatchDevice {
        match d {
            DispatchDevice::Autodiff(inner) => strip(inner.clone().inner()),
            d => d,
        }
    }
    strip(device.as_dispatch().clone())
}

/// Whether `device` is Flex's (Burn's CPU backend), autodiff or not.
pub fn is_flex(device: &Device) -> bool {
    matches!(base_device(device), DispatchDevice::Flex(_))
}
