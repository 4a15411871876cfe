//! Keeps GPU driver libraries mapped for the life of the process.
//!
//! wgpu loads drivers with `dlopen` (the Vulkan loader its ICDs, EGL the Mesa DRI
//! driver) and unloads them when the last instance is dropped. Mesa's drivers leave
//! exit-time handlers behind; once a driver has been unloaded, `exit` can jump into
//! unmapped memory and the process dies with SIGSEGV after its work is done (seen
//! with lavapipe and llvmpipe in roughly one test process in ten). A node creates
//! and drops instances whenever it probes or rebuilds a device, so after each probe
//! every library then loaded is marked `RTLD_NODELETE`: a later `dlclose` leaves it
//! mapped. Libraries stay loaded anyway in a long-running node; this only stops them
//! from going away.

/// Marks every shared object loaded now as never to be unloaded.
#[cfg(target_os = "linux")]
pub(crate) fn keep_drivers_loaded() {
    use std::ffi::{c_int, c_void, CStr, CString};

    #[allow(unsafe_code)]
    unsafe extern "C" fn collect(
        info: *mut libc::dl_phdr_info,
        _size: libc::size_t,
        names: *mut c_void,
    ) -> c_int {
        // SAFETY: the loader passes a valid `dl_phdr_info` for the duration of the
        // call, and `names` is the `Vec` handed to `dl_iterate_phdr` below.
        #[allow(unsafe_code)]
        unsafe {
            let names = &mut *names.cast::<Vec<CString>>();
            let name = (*info).dlpi_name;
            if !name.is_null() {
                let name = CStr::from_ptr(name);
                if !name.is_empty() {
                    names.push(name.to_owned());
                }
            }
        }
        0
    }

    let mut names: Vec<CString> = Vec::new();
    // SAFETY: `collect` only reads the entry it is given and pushes onto `names`,
    // which outlives the call.
    #[allow(unsafe_code)]
    unsafe {
        libc::dl_iterate_phdr(Some(collect), (&mut names as *mut Vec<CString>).cast());
    }
    for name in names {
        // SAFETY: RTLD_NOLOAD only takes a reference to an object that is already
        // loaded (no constructors run); RTLD_NODELETE keeps it mapped. The handle is
        // deliberately never closed.
        #[allow(unsafe_code)]
        unsafe {
            libc::dlopen(
                name.as_ptr(),
                libc::RTLD_LAZY | libc::RTLD_NOLOAD | libc::RTLD_NODELETE,
            );
        }
    }
}

#[cfg(not(target_os = "linux"))]
pub(crate) fn keep_drivers_loaded() {}
