//! Round trips and hostile bytes through the codec and the envelope.

#![allow(clippy::unwrap_used)] // tests unwrap: a failure should stop the test

use gpumesh_protocol::{
    codec, open, seal, AdapterLimits, BackendKind, BindingRole, BindingSpec, BlobId, DeviceKind,
    ElemType, Grid, MergeRule, NodeCapability, ProtocolError, ShaderSource, TaskSpec, WIRE_VERSION,
};
use proptest::prelude::*;

fn elem() -> impl Strategy<Value = ElemType> {
    prop_oneof![
        Just(ElemType::U32),
        Just(ElemType::I32),
        Just(ElemType::F32)
    ]
}

fn merge() -> impl Strategy<Value = MergeRule> {
    prop_oneof![
        Just(MergeRule::Concat),
        elem().prop_map(MergeRule::Sum),
        elem().prop_map(MergeRule::Min),
        elem().prop_map(MergeRule::Max),
    ]
}

fn role() -> impl Strategy<Value = BindingRole> {
    prop_oneof![
        (any::<[u8; 32]>(), any::<u64>()).prop_map(|(h, size)| BindingRole::Input {
            blob: BlobId(h),
            size
        }),
        proptest::collection::vec(any::<u8>(), 0..64).prop_map(|data| BindingRole::Param { data }),
        any::<u64>().prop_map(|size| BindingRole::Output { size }),
    ]
}

fn task() -> impl Strategy<Value = TaskSpec> {
    (
        prop_oneof![
            ".*".prop_map(ShaderSource::Wgsl),
            "[a-z_]{1,12}".prop_map(ShaderSource::Builtin)
        ],
        "[a-z_]{1,8}",
        proptest::collection::vec((any::<u32>(), role()), 0..6),
        any::<[u32; 3]>(),
        any::<u32>(),
        merge(),
    )
        .prop_map(
            |(shader, entry_point, bindings, grid, shards, merge)| TaskSpec {
                shader,
                entry_point,
                bindings: bindings
                    .into_iter()
                    .map(|(binding, role)| BindingSpec { binding, role })
                    .collect(),
                grid: Grid(grid),
                shards,
                merge,
            },
        )
}

fn capability() -> impl Strategy<Value = NodeCapability> {
    (
        ".{0,20}",
        any::<u32>(),
        any::<[u32; 8]>(),
        0.0f64..1e6,
        0.0f64..1e4,
    )
        .prop_map(|(adapter_name, vendor, l, gflops, gbps)| NodeCapability {
            adapter_name,
            vendor,
            backend: BackendKind::Vulkan,
            device_kind: DeviceKind::Cpu,
            driver: "test".into(),
            limits: AdapterLimits {
                max_buffer_size: u64::from(l[0]) << 8,
                max_storage_buffer_binding_size: l[1],
                max_uniform_buffer_binding_size: l[2],
                max_storage_buffers_per_shader_stage: l[3],
                max_compute_workgroups_per_dimension: l[4],
                max_compute_invocations_per_workgroup: l[5],
                max_compute_workgroup_size: [l[6], l[7], 64],
                max_compute_workgroup_storage_size: 16384,
            },
            gflops,
            gbps,
        })
}

proptest! {
    #[test]
    fn task_round_trips(spec in task()) {
        let bytes = seal(&spec).unwrap();
        let back: TaskSpec = open(&bytes).unwrap();
        prop_assert_eq!(back, spec);
    }

    #[test]
    fn capability_round_trips(cap in capability()) {
        let back: NodeCapability = open(&seal(&cap).unwrap()).unwrap();
        prop_assert_eq!(back, cap);
    }

    #[test]
    fn garbage_is_an_error_not_a_panic(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
        let _ = open::<TaskSpec>(&bytes);
        let _ = open::<NodeCapability>(&bytes);
        let _ = codec::from_bytes::<TaskSpec>(&bytes);
    }

    #[test]
    fn garbage_after_a_valid_header_is_an_error(
        tail in proptest::collection::vec(any::<u8>(), 0..512)
    ) {
        let mut bytes = b"GPMH".to_vec();
        bytes.extend_from_slice(&WIRE_VERSION.to_le_bytes());
        bytes.extend_from_slice(&tail);
        // Decoding may succeed by chance on short tails; it must never panic.
        let _ = open::<TaskSpec>(&bytes);
    }

    #[test]
    fn truncated_messages_are_errors(spec in task(), cut in 0usize..64) {
        let bytes = seal(&spec).unwrap();
        let cut = cut.min(bytes.len().saturating_sub(1));
        prop_assert!(open::<TaskSpec>(&bytes[..bytes.len() - 1 - cut]).is_err());
    }
}

#[test]
fn another_wire_version_is_detected() {
    let mut bytes = seal(&MergeRule::Concat).unwrap();
    bytes[4..6].copy_from_slice(&(WIRE_VERSION + 1).to_le_bytes());
    assert_eq!(
        open::<MergeRule>(&bytes),
        Err(ProtocolError::VersionMismatch {
            ours: WIRE_VERSION,
            theirs: WIRE_VERSION + 1
        })
    );
}

#[test]
fn wrong_magic_and_short_frames_are_detected() {
    assert!(matches!(
        open::<MergeRule>(b"HTTP/1.1 200"),
        Err(ProtocolError::BadMagic { .. })
    ));
    assert!(matches!(
        open::<MergeRule>(b"GP"),
        Err(ProtocolError::TooShort { .. })
    ));
}

#[test]
fn a_huge_length_prefix_is_refused_without_allocating() {
    // A Vec<u8> claiming u64::MAX elements.
    let mut bytes = b"GPMH".to_vec();
    bytes.extend_from_slice(&WIRE_VERSION.to_le_bytes());
    bytes.push(253); // varint marker for a u64
    bytes.extend_from_slice(&u64::MAX.to_le_bytes());
    assert!(open::<Vec<u8>>(&bytes).is_err());
}

#[test]
fn merge_rules_and_grids_parse() {
    for s in [
        "concat", "sum-u32", "sum-i32", "sum-f32", "min-f32", "max-i32",
    ] {
        let rule: MergeRule = s.parse().unwrap();
        assert_eq!(rule.to_string(), s);
    }
    assert!("avg-f32".parse::<MergeRule>().is_err());
    assert!("sum-f64".parse::<MergeRule>().is_err());
    assert_eq!(Grid([4, 5, 6]).total(), 120);
    assert_eq!(
        Grid([u32::MAX, u32::MAX, 1]).total(),
        u64::from(u32::MAX).pow(2)
    );
    assert_eq!(
        Grid([u32::MAX, u32::MAX, 2]).total(),
        u64::MAX,
        "saturates, never wraps"
    );
    assert_eq!(Grid([u32::MAX; 3]).total(), u64::MAX);
    assert_eq!("4".parse::<Grid>().unwrap(), Grid([4, 1, 1]));
    assert_eq!("4,5,6".parse::<Grid>().unwrap(), Grid([4, 5, 6]));
    assert!("4,0".parse::<Grid>().is_err());
    assert!("1,2,3,4".parse::<Grid>().is_err());
    assert!("x".parse::<Grid>().is_err());
}

#[test]
fn blob_ids_are_content_addresses() {
    let id = BlobId::of(b"hello");
    assert!(id.matches(b"hello"));
    assert!(!id.matches(b"hellO"));
    assert_eq!(id.to_string().parse::<BlobId>().unwrap(), id);
    assert!("zz".parse::<BlobId>().is_err());
}
