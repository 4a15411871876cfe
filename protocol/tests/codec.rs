//! Round trips and hostile bytes through the codec and the envelope: arbitrary bytes
//! and arbitrary mutations of valid messages of every wire type decode to a value or
//! an error, never a panic. `PROPTEST_CASES=N` runs more cases.

#![allow(clippy::unwrap_used)] // tests unwrap: a failure should stop the test

use gpumesh_protocol::{
    codec, open, seal, AdapterLimits, BackendKind, BindingRole, BindingSpec, BlobId, DeviceKind,
    ElemType, Grid, MergeRule, MeshRequest, MeshResponse, NodeCapability, ProtocolError,
    ShaderSource, TaskSpec, FORMAT,
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
        Just(MergeRule::Changes),
        elem().prop_map(MergeRule::Sum),
        elem().prop_map(MergeRule::Min),
        elem().prop_map(MergeRule::Max),
        int().prop_map(MergeRule::Or),
        int().prop_map(MergeRule::And),
        int().prop_map(MergeRule::Xor),
    ]
}

fn int() -> impl Strategy<Value = ElemType> {
    prop_oneof![Just(ElemType::U32), Just(ElemType::I32)]
}

fn role() -> impl Strategy<Value = BindingRole> {
    prop_oneof![
        (any::<[u8; 32]>(), any::<u64>()).prop_map(|(h, size)| BindingRole::Input {
            blob: BlobId(h),
            size
        }),
        proptest::collection::vec(any::<u8>(), 0..64).prop_map(|data| BindingRole::Param { data }),
        any::<u64>().prop_map(|size| BindingRole::Output { size }),
        (any::<[u8; 32]>(), any::<u64>()).prop_map(|(h, size)| BindingRole::InOut {
            blob: BlobId(h),
            size
        }),
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
                merges: Default::default(),
                options: Default::default(),
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
            memory: u64::from(vendor) << 8,
        })
}

fn bytes(max: usize) -> impl Strategy<Value = Vec<u8>> {
    proptest::collection::vec(any::<u8>(), 0..max)
}

fn request() -> impl Strategy<Value = MeshRequest> {
    prop_oneof![
        (any::<[u8; 32]>(), any::<u64>(), any::<u32>()).prop_map(|(h, offset, len)| {
            MeshRequest::BlobChunk {
                id: BlobId(h),
                offset,
                len,
            }
        }),
        bytes(256).prop_map(MeshRequest::Node),
    ]
}

fn response() -> impl Strategy<Value = MeshResponse> {
    prop_oneof![
        (any::<u64>(), bytes(256))
            .prop_map(|(total, data)| MeshResponse::BlobChunk { total, data }),
        Just(MeshResponse::NotFound),
        bytes(256).prop_map(MeshResponse::Node),
        ".{0,80}".prop_map(MeshResponse::Error),
    ]
}

/// One edit of a valid frame. Positions are taken modulo the frame's length.
#[derive(Clone, Debug)]
enum Mutation {
    /// XOR one byte with a non-zero value, so it always changes.
    Flip(usize, u8),
    Insert(usize, Vec<u8>),
    Remove(usize, usize),
    Truncate(usize),
    /// Overwrite four bytes with a little-endian u32 (a length or a count).
    Plant(usize, u32),
}

fn mutation() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        (any::<usize>(), 1u8..).prop_map(|(at, x)| Mutation::Flip(at, x)),
        (
            any::<usize>(),
            proptest::collection::vec(any::<u8>(), 1..16)
        )
            .prop_map(|(at, b)| Mutation::Insert(at, b)),
        (any::<usize>(), 1usize..16).prop_map(|(at, n)| Mutation::Remove(at, n)),
        any::<usize>().prop_map(Mutation::Truncate),
        (any::<usize>(), any::<u32>()).prop_map(|(at, v)| Mutation::Plant(at, v)),
    ]
}

fn mutate(mut frame: Vec<u8>, edits: &[Mutation]) -> Vec<u8> {
    for edit in edits {
        let len = frame.len().max(1);
        match edit {
            Mutation::Flip(at, x) => {
                if let Some(b) = frame.get_mut(at % len) {
                    *b ^= x;
                }
            }
            Mutation::Insert(at, b) => {
                let at = at % (frame.len() + 1);
                frame.splice(at..at, b.iter().copied());
            }
            Mutation::Remove(at, n) => {
                let at = at % len;
                let end = (at + n).min(frame.len());
                if at < end {
                    frame.drain(at..end);
                }
            }
            Mutation::Truncate(at) => frame.truncate(at % len),
            Mutation::Plant(at, v) => {
                let at = at % len;
                for (i, b) in v.to_le_bytes().into_iter().enumerate() {
                    if let Some(slot) = frame.get_mut(at + i) {
                        *slot = b;
                    }
                }
            }
        }
    }
    frame
}

/// Decodes `bytes` as every wire type, through the envelope and through the bare
/// codec. Whatever decodes must encode again: a decoded value is a real value.
fn decode_everything(bytes: &[u8]) {
    fn both<T: serde::de::DeserializeOwned + serde::Serialize>(bytes: &[u8]) {
        if let Ok(value) = open::<T>(bytes) {
            seal(&value).expect("a decoded value seals again");
        }
        if let Ok(value) = codec::from_bytes::<T>(bytes) {
            codec::to_bytes(&value).expect("a decoded value encodes again");
        }
    }
    both::<TaskSpec>(bytes);
    both::<NodeCapability>(bytes);
    both::<MeshRequest>(bytes);
    both::<MeshResponse>(bytes);
    both::<Vec<u8>>(bytes);
    both::<String>(bytes);
}

/// Any valid frame of any wire type.
fn valid_frame() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        task().prop_map(|t| seal(&t).unwrap()),
        capability().prop_map(|c| seal(&c).unwrap()),
        request().prop_map(|r| seal(&r).unwrap()),
        response().prop_map(|r| seal(&r).unwrap()),
    ]
}

proptest! {
    #[test]
    fn mesh_messages_round_trip(req in request(), resp in response()) {
        prop_assert_eq!(open::<MeshRequest>(&seal(&req).unwrap()).unwrap(), req);
        prop_assert_eq!(open::<MeshResponse>(&seal(&resp).unwrap()).unwrap(), resp);
    }

    #[test]
    fn arbitrary_bytes_decode_as_any_type_without_panicking(
        raw in bytes(1024),
        with_header in any::<bool>(),
    ) {
        let mut frame = Vec::new();
        if with_header {
            frame.extend_from_slice(b"GPMH");
            frame.extend_from_slice(&FORMAT.to_le_bytes());
        }
        frame.extend_from_slice(&raw);
        decode_everything(&frame);
    }

    #[test]
    fn mutated_valid_messages_decode_without_panicking(
        frame in valid_frame(),
        edits in proptest::collection::vec(mutation(), 1..6),
    ) {
        decode_everything(&mutate(frame, &edits));
    }

    #[test]
    fn a_changed_magic_or_version_byte_is_always_an_error(
        frame in valid_frame(),
        at in 0usize..6,
        x in 1u8..,
    ) {
        let bad = mutate(frame, &[Mutation::Flip(at, x)]);
        prop_assert!(open::<TaskSpec>(&bad).is_err());
        prop_assert!(open::<MeshRequest>(&bad).is_err());
        prop_assert!(open::<MeshResponse>(&bad).is_err());
        prop_assert!(open::<NodeCapability>(&bad).is_err());
    }
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
        bytes.extend_from_slice(&FORMAT.to_le_bytes());
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
    let mut bytes = seal(&MergeRule::Changes).unwrap();
    bytes[4..6].copy_from_slice(&(FORMAT + 1).to_le_bytes());
    assert_eq!(
        open::<MergeRule>(&bytes),
        Err(ProtocolError::VersionMismatch {
            ours: FORMAT,
            theirs: FORMAT + 1
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
    bytes.extend_from_slice(&FORMAT.to_le_bytes());
    bytes.push(253); // varint marker for a u64
    bytes.extend_from_slice(&u64::MAX.to_le_bytes());
    assert!(open::<Vec<u8>>(&bytes).is_err());
}

#[test]
fn a_merge_rule_for_a_binding_that_is_not_written_is_refused() {
    let mut spec = TaskSpec {
        shader: ShaderSource::Builtin("x".into()),
        entry_point: "main".into(),
        bindings: vec![
            BindingSpec {
                binding: 0,
                role: BindingRole::Param { data: vec![0; 16] },
            },
            BindingSpec {
                binding: 1,
                role: BindingRole::Output { size: 16 },
            },
        ],
        grid: Grid([1, 1, 1]),
        shards: 1,
        merge: MergeRule::Changes,
        merges: [(1, MergeRule::Sum(ElemType::U32))].into(),
        options: Default::default(),
    };
    spec.check_shape().unwrap();
    assert_eq!((spec.binding_bytes(), spec.writable_bytes()), (32, 16));
    assert_eq!(spec.merge_of(1), MergeRule::Sum(ElemType::U32));
    assert_eq!(spec.merge_label(), "changes, 1=sum-u32");
    for binding in [0, 7] {
        spec.merges = [(binding, MergeRule::Sum(ElemType::U32))].into();
        let e = spec.check_shape().unwrap_err().to_string();
        assert!(e.contains(&format!("binding {binding}")), "{e}");
    }
}

#[test]
fn blob_ids_are_32_bytes_on_the_wire_and_hex_in_json() {
    let id = BlobId::of(b"abc");
    assert_eq!(
        gpumesh_protocol::codec::to_bytes(&id).unwrap(),
        id.0.to_vec()
    );
    let json = serde_json::to_string(&id).unwrap();
    assert_eq!(json, format!("\"{}\"", id.to_hex()));
    assert_eq!(serde_json::from_str::<BlobId>(&json).unwrap(), id);
    let array = serde_json::to_string(&id.0).unwrap();
    assert_eq!(serde_json::from_str::<BlobId>(&array).unwrap(), id);
    let bad = serde_json::from_str::<BlobId>("\"xyz\"")
        .unwrap_err()
        .to_string();
    assert!(bad.contains("64 hex digits"), "{bad}");
}

#[test]
fn merge_rules_and_grids_parse() {
    for s in [
        "changes", "sum-u32", "sum-i32", "sum-f32", "min-f32", "max-i32", "or-u32", "and-i32",
        "xor-u32",
    ] {
        let rule: MergeRule = s.parse().unwrap();
        assert_eq!(rule.to_string(), s);
    }
    // The default, and the rule's earlier name.
    assert_eq!(MergeRule::default(), MergeRule::Changes);
    assert_eq!("concat".parse::<MergeRule>().unwrap(), MergeRule::Changes);
    assert!("avg-f32".parse::<MergeRule>().is_err());
    assert!("sum-f64".parse::<MergeRule>().is_err());
    // Bitwise merges take integers only.
    let e = "or-f32".parse::<MergeRule>().unwrap_err().to_string();
    assert!(
        e.contains("or|and|xor") && e.contains("-u32 or -i32"),
        "{e}"
    );
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
